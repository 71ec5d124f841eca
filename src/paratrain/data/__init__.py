"""Data: the bundled corpus (``corpus.txt.gz``), and tokenized datasets made by
``paratrain data prepare`` (``prepare.py``) and read as memory-mapped shards (``dataset.py``)."""
