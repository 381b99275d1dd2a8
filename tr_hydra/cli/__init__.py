"""The command-line tools. Importing this package (every tool does, before PyTorch) keeps
Python's bytecode in tr_hydra's cache where the environment keeps none (``tr_hydra.bytecode``)."""
from tr_hydra import bytecode as _bytecode

_bytecode.keep()
