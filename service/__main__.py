from service.cli import main

# Guarded: uvicorn's worker processes are spawned, and spawn imports this module again (as
# __mp_main__); unguarded, every worker would run the command line once more.
if __name__ == "__main__":
    raise SystemExit(main())
