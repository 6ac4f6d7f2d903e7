"""`python -m ddpjob`: the same CLI as the `ddpjob` console script."""

from ddpjob.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
