"""The package version, in a module of its own so that any module can name the
writer of a manifest without importing the package's ``__init__``."""
__version__ = "0.1.0"
