"""`blockspec train-draft`: train a DFlash draft for a frozen target (the DFlash recipe).

features.py    the one place that asks the target for context features (and greedy text)
data.py        text files / JSONL → fixed-length token examples; batch order and anchors
blockwise.py   many anchors per sequence in one draft forward under a block-sparse mask; loss
checkpoint.py  z-lab-format drafts and the resumable training state
corpus.py      the Python standard library's source as a corpus (the default --data)
loop.py        the training loop: DDP, progress, evaluation through our engine, checkpoints
"""
