"""Development tools, run from the repository's root: not part of the installed package."""
