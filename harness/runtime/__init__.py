"""What runs a model on the paged pool: the K/V store, the attention hook, HF's ``Cache``
adapter and the continuous-batching engine. It computes; it checks nothing."""
