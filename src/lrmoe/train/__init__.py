"""Training: one idea per module.

``config`` (run config, validation), ``data`` (corpus, tokenizer, batches), ``groups`` (EP/DP
process groups, all-reduces, device), ``build`` (the model, routing traces), ``metrics`` (per-step
records, progress), ``loop`` (the training loop), ``checkpoint`` / ``files`` (crash-safe state),
``worker`` (a rank's entry point), ``launch`` (starting the ranks), ``compare`` / ``report``
(``lrmoe compare`` and its report).
"""
