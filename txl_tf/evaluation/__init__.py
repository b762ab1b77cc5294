"""Evaluation: the segment-recurrent and sliding-window loops over a split (loops)."""
