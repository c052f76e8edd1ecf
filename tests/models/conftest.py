"""The real-model suite: tiny models trained on `neuron` in every engine mode, against plain CPU.

Hugging Face models are built from configs with random weights; nothing may reach the network.
"""
import os

# Set before transformers is imported by any test module of this package.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
