"""raw: the identity codec, the baseline every test compares to.

One folder per codec: ``codec.py`` (layout, pure-torch reference, codec class and its descriptor).
Importing this package registers the codec.
"""

from .codec import *  # noqa: F401,F403  (registers; the format's public names)
from .codec import __all__
