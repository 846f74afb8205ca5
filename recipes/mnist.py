"""Train the Keras mnist_cnn with AsyncPSStrategy: `python recipes/mnist.py --workers 2 --mode asgd`."""

from plug_asgd.recipes.mnist import main

if __name__ == "__main__":
    main()
