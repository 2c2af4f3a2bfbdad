"""`python -m clover_cli`: the clover command, from whichever checkout is on the path (scripts and tests run it so)."""

from .process import main

main()
