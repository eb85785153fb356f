"""The folder ms-swift's ``--external_plugins`` puts on ``sys.path``: it holds the plug-in file only."""
