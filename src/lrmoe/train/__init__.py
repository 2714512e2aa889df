"""Training: one idea per module.

``config`` (run config, validation), ``data`` (corpus, tokenizer, batches), ``groups`` (EP/DP
process groups, all-reduces, device), ``build`` (the model, routing traces), ``metrics`` (per-step
records, progress), ``loop`` (the training loop), ``resume`` (where a run starts: a checkpoint's
step, history and data position), ``state`` (a rank's state under keys that do not depend on the
world size), ``checkpoint`` / ``files`` (crash-safe state), ``worker`` (a rank's entry point),
``launch`` / ``rendezvous`` (starting the ranks, on one machine or several), ``compare`` /
``report`` / ``plots`` (``lrmoe compare``, its tables and its plots), ``sweep`` (``--memory-caps``).
"""
