"""``python -m loadtests``: the experiment grid (see ``loadtests.bench``)."""

from loadtests.bench import main

main()
