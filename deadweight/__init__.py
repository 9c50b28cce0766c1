"""deadweight: catch fine-tuning runs that report a healthy loss while their weights stay frozen.

The packages live in top-level folders (``callbacks/``, ``sidecar/``, ``proto/``, ``demo/``);
this folder links them under one import name, ``deadweight.*``, and holds the ``deadweight``
command (``cli.py``), which adds ``demo`` to the sidecar's commands.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deadweight")
except PackageNotFoundError:  # running from a checkout without an install
    __version__ = "0.0.0"
