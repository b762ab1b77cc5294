"""Experiments as code: the paper's findings reproduced at CPU scale (`python -m txl_tf.study`).

    runs.py      run specs, training through txl_tf.train, cached per-token evaluations, results.json
    ablation.py  studies `ablation` (Tables 5/6 analogue) and `recl` (appendix C)
    corpus_choice.py  study `corpora`: what each corpus repeats, measured before training
    context.py, context_results.py  studies `context[_MODEL]` and `context_code[_MODEL]`: six models (the
                 paper's four, RoPE and ALiBi with recurrence), the memory axis, RECL and a copy probe on
                 enwik8_sample and networkx_code
    ptb.py       study `ptb`: a Penn Treebank recipe for 2 CPU cores, with a vanilla model on the same budget
    report.py    report.md / docs/reproduction.md and the plots, rendered from results.json only
    results_schema.py  the shape of results.json the report reads, checked when it is read
    sanity.py    checks on a model's scores before a verdict reads them (a baseline worse at its own window)
"""
