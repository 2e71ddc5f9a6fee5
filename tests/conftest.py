"""Suite-wide settings: tests use tiny models, where one intra-op thread is fastest and immune to the
OpenMP stalls that a loaded 2-core machine causes."""

import torch

torch.set_num_threads(1)
