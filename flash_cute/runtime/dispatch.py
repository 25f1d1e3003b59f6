"""Which pipeline runs a problem: chosen by compute capability and capability set.

`PIPELINES` lists every built pipeline's descriptor (`flash_cute.contract.descriptor.Pipeline`),
newest first; the dispatcher picks, in that order, the first that runs on the device, has been run
on hardware (`hardware_tested`; or is allowed by ``FLASH_CUTE_ALLOW_UNTESTED``), has every
capability the problem needs and takes it (`Pipeline.takes`). ``arch=`` names one instead
(compile-verified ones included). The backward
runs in the forward's pipeline when it has one, else in the newest that has a backward and
can run the problem: the forward's (O, LSE) are the same in every pipeline.
"""

import os
from typing import Optional

import torch

from flash_cute.arch.ampere.planner import PIPELINE as AMPERE
from flash_cute.arch.blackwell.planner import PIPELINE as BLACKWELL
from flash_cute.arch.hopper.planner import PIPELINE as HOPPER
from flash_cute.contract.descriptor import Pipeline, required_capabilities
from flash_cute.runtime.device import capability_of

PIPELINES = (BLACKWELL, HOPPER, AMPERE)
# Compile-verified pipelines dispatch may also pick by itself (`admitted`).
ALLOW_UNTESTED_ENV = "FLASH_CUTE_ALLOW_UNTESTED"


def pipeline_named(name: str) -> Pipeline:
    for p in PIPELINES:
        if p.name == name:
            return p
    built = ", ".join(sorted(p.name for p in PIPELINES))
    raise NotImplementedError(f"arch={name!r}: no such pipeline is built (built: {built})")


def select_pipeline(device: torch.device, arch: Optional[str] = None, problem=None,
                    backward: bool = False) -> Pipeline:
    """The pipeline to run on `device`: `arch` if given (and able to run there), else the
    newest hardware-tested one that has the capabilities `problem`'s forward needs and takes
    it (`Pipeline.takes`; with `backward`, its backward too)."""
    major = capability_of(device)[0]
    if arch is not None:
        chosen = pipeline_named(arch)
        if not chosen.runs_on(major):
            majors = chosen.majors
            raise ValueError(f"arch={arch!r} runs on compute capability {majors[0]}.x to "
                             f"{majors[-1]}.x; {torch.cuda.get_device_name(device)} is {major}.x")
        return chosen
    needed = () if problem is None else required_capabilities(problem)
    runs_here = [p for p in PIPELINES if p.runs_on(major) and admitted(p)]
    for p in runs_here:
        if p.missing(needed) is None and (problem is None or p.takes is None
                                          or p.takes(problem, backward)):
            return p
    if runs_here:
        # Pipelines run here but lack what the problem asks for: say what.
        check_capabilities(runs_here[0], needed)
        raise NotImplementedError(f"no pipeline on compute capability {major}.x takes this "
                                  "problem")
    raise NotImplementedError(f"no pipeline runs on compute capability {major}.x")


def admitted(pipeline: Pipeline) -> bool:
    """Whether dispatch may pick `pipeline` on its own: it ran on hardware, or it is named in
    ``FLASH_CUTE_ALLOW_UNTESTED`` (comma-separated pipeline names, e.g. "blackwell")."""
    allowed = os.environ.get(ALLOW_UNTESTED_ENV, "")
    return pipeline.hardware_tested or pipeline.name in {n.strip() for n in allowed.split(",")}


def check_capabilities(pipeline: Pipeline, needed: tuple) -> None:
    """NotImplementedError, before any launch, when `pipeline` lacks a capability of
    `needed`, naming it and the pipelines that have it."""
    missing = pipeline.missing(needed)
    if missing is not None:
        takers = [p.name for p in PIPELINES if p.missing(needed) is None]
        raise NotImplementedError(f"{missing}: not supported by the {pipeline.name} pipeline yet; "
                                  f"pipelines that support it: {', '.join(takers) or 'none'}")


def select_backward_pipeline(device: torch.device, forward: Pipeline, problem=None,
                             deterministic: bool = False) -> Pipeline:
    """The forward's pipeline if it has a backward (refusing, by name, what that backward
    lacks), else the newest hardware-tested one on `device` with a backward that can run
    `problem` (when given)."""
    needed = ("backward",) if problem is None else required_capabilities(
        problem, backward=True, deterministic=deterministic)
    if forward.has_backward:
        check_capabilities(forward, needed)
        return forward
    major = capability_of(device)[0]
    for p in PIPELINES:
        if p.runs_on(major) and p.hardware_tested and p.missing(needed) is None:
            return p
    takers = [p for p in PIPELINES if p.runs_on(major) and p.has_backward]
    if takers:
        check_capabilities(takers[0], needed)
    raise NotImplementedError(f"no pipeline has a backward for compute capability {major}.x")


def choose_pipelines(device: torch.device, arch: Optional[str], problem, backward: bool = False,
                     deterministic: bool = False, forward_checks: bool = True) -> tuple:
    """A call's one dispatch decision: (the forward's pipeline, the backward's or None), each
    checked against what `problem` needs, its capabilities and then the pipeline's own limits
    (head dims, shared memory). `forward_checks=False`: a backward call, whose forward ran."""
    forward = select_pipeline(device, arch, problem, backward)
    if forward_checks:
        check_capabilities(forward, required_capabilities(problem))
        forward.check_supported(problem, device)
    if not backward:
        return forward, None
    bwd = select_backward_pipeline(device, forward, problem, deterministic)
    bwd.check_supported(problem, device, backward=True)
    return forward, bwd
