"""The sidecar's command line: ``deadweight serve``, ``status``, ``runs``, ``stop``,
``silence``, ``inspect``, ``report``, ``baseline`` and their arguments, one module a
command (``cli`` builds the parser). Nothing in the daemon imports this package."""
