from batchrun.cli import main

main()
