"""Train a byte-level GPT on Debian's fortune cookies with AsyncPSStrategy: `python recipes/lm.py --workers 2`."""

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the cycle collector's passes over them
    from plug_asgd.recipes.lm import main

if __name__ == "__main__":
    main()
