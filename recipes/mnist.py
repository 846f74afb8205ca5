"""Train the Keras mnist_cnn with AsyncPSStrategy: `python recipes/mnist.py --workers 2 --mode asgd`."""

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the cycle collector's passes over them
    from plug_asgd.recipes.mnist import main

if __name__ == "__main__":
    main()
