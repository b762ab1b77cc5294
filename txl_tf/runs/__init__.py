"""A run folder: its files, checkpoints and saved configuration (run_dir) and the model loaded from it (loading)."""
