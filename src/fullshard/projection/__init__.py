"""Scale projection: step time, throughput, MFU and memory of fullshard training at
8-1024 GPUs, before buying them (docs/projection.md)."""

from .calibrate import calibrated_cpu, fit_link
from .compute import FITTED, PRIOR, KernelConstants
from .hardware import DEVICES, Cluster, Device, Link, ProjectionError, device_named
from .project import (Projection, Settings, memory_per_rank, project, rank_configurations,
                      train_flags)
from .shapes import SHAPES, ModelShape, shape_named, shape_of

__all__ = ["DEVICES", "FITTED", "SHAPES", "Cluster", "Device", "KernelConstants", "Link",
           "ModelShape", "PRIOR", "Projection", "ProjectionError", "Settings", "calibrated_cpu",
           "device_named", "fit_link", "memory_per_rank", "project", "rank_configurations",
           "shape_named", "shape_of", "train_flags"]
