from batchrun.cli import entry

entry()
