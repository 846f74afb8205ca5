"""Train a CNN, AlexNet or ResNet-18 on CIFAR-10 with AsyncPSStrategy: `python recipes/cifar10.py --arch resnet18`."""

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the cycle collector's passes over them
    from plug_asgd.recipes.cifar10 import main

if __name__ == "__main__":
    main()
