"""Training data for a cluster: corpora, tokenisation, train/eval splits and batch sampling."""
