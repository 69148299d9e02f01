"""delta_ans: delta's changes entropy-coded with interleaved rANS.

One folder per codec: ``codec.py`` (layout, pure-torch reference, codec class and its descriptor),
``native.py`` (the C twin's wrappers; C in ``ciera/native/csrc``) and ``kernels.py`` (the Triton
twins). Importing this package registers the codec.
"""

from .codec import *  # noqa: F401,F403  (registers; the format's public names)
from .codec import __all__
