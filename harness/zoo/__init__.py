"""Models: the zoo's nets at their papers' sizes (``nets``, each described by a ``NetSpec``, ``netspec``), any other
model by ``SOURCE:NAME`` (``models``: torchvision, timm, Hugging Face, a user's own factory), and Kusumoto et al.
2019's own graphs (``paper_graphs``)."""
