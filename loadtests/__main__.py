"""``python -m loadtests``: the experiment grid (see ``loadtests.harness.bench``)."""

from loadtests.harness.bench import main

main()
