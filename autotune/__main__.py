"""`python -m autotune ...` (as under `torchrun ... -m autotune search`): the `autotune` command."""

from autotune.cli import main

if __name__ == "__main__":
    main()
