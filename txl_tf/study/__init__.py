"""Experiments as code: the paper's findings reproduced at CPU scale (`python -m txl_tf.study`).

    runs.py      run specs, training through txl_tf.train, cached per-token evaluations, results.json
    ablation.py  studies `ablation` (Tables 5/6 analogue) and `recl` (appendix C)
    ptb.py       study `ptb`: a Penn Treebank recipe for 2 CPU cores, with a vanilla model on the same budget
    report.py    report.md / docs/reproduction.md and the plots, rendered from results.json only
"""
