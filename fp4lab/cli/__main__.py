"""`python -m fp4lab.cli ...`, as sweep jobs and torchrun start fp4lab."""

from fp4lab.cli import main

if __name__ == "__main__":
    main()
