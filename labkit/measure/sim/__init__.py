"""A cluster simulator in virtual time that runs labkit's own scheduler, priced by a cost model fitted to this
device's measured steps: P:D ratios, link bandwidths, prompt mixes and rates one machine cannot show.
Introduced in notebook 12 (``12_disaggregated_prefill``)."""

from labkit.measure.sim.calibrate import calibrate, measured_records, poisson_requests
from labkit.measure.sim.cluster import ClusterSpec, SimRequest, SimResult, simulate
from labkit.measure.sim.cost_model import RecordingScheduler, StepCostModel, StepShape
from labkit.measure.sim.runner import SimInstance, SimulatedModelRunner
from labkit.measure.sim.tensor_parallel import TensorParallelCost, TensorParallelSpec

__all__ = ["ClusterSpec", "RecordingScheduler", "SimInstance", "SimRequest", "SimResult", "SimulatedModelRunner",
           "StepCostModel", "StepShape", "TensorParallelCost", "TensorParallelSpec", "calibrate", "measured_records",
           "poisson_requests", "simulate"]
