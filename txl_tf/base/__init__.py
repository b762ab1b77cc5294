"""The base of every stage: errors, paths, untrusted files, staged writes, run locks, the command-line set-up and the version. Imports no TensorFlow or Keras (tests/test_build_targets.py)."""
