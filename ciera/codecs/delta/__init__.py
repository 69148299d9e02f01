"""delta: lossless temporal delta of whole bit patterns, packed at widths the exponent predicts.

One folder per codec: ``codec.py`` (layout, pure-torch reference, codec class and its descriptor),
``native.py`` (the C twin's wrappers; C in ``ciera/native/csrc``) and ``kernels.py`` (the Triton
twins). Importing this package registers the codec.
"""

from .codec import *  # noqa: F401,F403  (registers; the format's public names)
from .codec import __all__
