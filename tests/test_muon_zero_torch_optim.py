"""PyTorch's device-generic optimizer tests (TestOptimRenewed in pytorch's test/test_optim.py),
written again for MuonZeRO: the contract torch users rely on, checked the way torch checks its own.

The machinery is torch's (torch.testing._internal: OptimizerInfo, @optims, the device-generic
instantiation); MuonZeRO's OptimizerInfo routes the tensors each test passes as muon_param_groups
routes a model's (a matrix to Muon, anything below 2-D to AdamW) and runs at one process, without a
process group (the multi-rank contract is tests/test_muon_zero.py's). Each test below keeps the
name and the property of torch's. Left out, as torch's OptimizerInfo flags leave them out for its
own Muon (supported_impls=(), supports_complex=False, supports_sparse=False), one line each:
  test_rosenbrock_sparse: sparse gradients are refused in step() (test_errors checks the refusal).
  test_complex, test_complex_2d: complex parameters are refused (test_errors).
  test_foreach_matches_forloop, test_fused_*, test_mixed_device_dtype, test_peak_memory_foreach,
    test_defaults_changed_to_foreach, test_set_default_dtype_works_with_foreach,
    test_foreach_large_tensor, test_cpu_load_state_dict: one implementation, no foreach or fused.
  test_second_order_optims_return_consistent_types: step() needs no closure.
  test_forloop_goes_right_direction_multigpu: MuonZeRO holds its parameters on one device.
test_state_dict_with_cuda_params runs where a GPU is visible (the suite hides it: conftest.py).
"""

import functools
import tempfile
import unittest
from copy import deepcopy

import pytest
import torch
from torch.nn import Parameter
from torch.optim import SGD
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_optimizers import (
    DecorateInfo,
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    optims,
)
from torch.testing._internal.common_utils import TestCase, parametrize

import muon_zero as mz

# common_utils freezes torch.backends' flags (cudnn, mkldnn) on import, for the whole pytest
# session: thaw them, so that this file changes nothing for the other test files
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
assert not torch.backends.flags_frozen(), "torch.backends' flags stay frozen after common_utils"


def route(params):
    """What torch's tests pass (tensors, (name, tensor) pairs, param groups) -> MuonZeRO param
    groups: each group split into a 'dense' group of its matrices and an 'adamw' one of the rest."""
    if isinstance(params, torch.Tensor):
        return params  # torch's own TypeError: params must be an iterable
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    routed = []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        tensor = [p[1] if isinstance(p, tuple) else p for p in ps]
        for role, keep in (("dense", lambda t: t.ndim >= 2), ("adamw", lambda t: t.ndim < 2)):
            mine = [p for p, t in zip(ps, tensor) if keep(t)]
            if mine or not ps:
                routed.append({**g, "params": mine, "role": role})
    return routed


class RoutedMuonZeRO(mz.MuonZeRO):
    """MuonZeRO over the tensors of torch's tests, routed as muon_param_groups routes a model's."""

    def __init__(self, params, **kwargs):
        super().__init__(route(params), **kwargs)


def optim_inputs(device, dtype=None):
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.2}, desc="non-default weight_decay"),
        OptimizerInput(params=None, kwargs={"momentum": 0.8}, desc="non-default momentum"),
        OptimizerInput(
            params=None,
            kwargs={"ns_coefficients": mz.STANDARD_NS_COEFFICIENTS},
            desc="torch.optim.Muon's Newton-Schulz",
        ),
        OptimizerInput(
            params=None,
            kwargs={"grad_sync": "exact", "ns_dtype": torch.float32},
            desc="exact gradients, fp32 Newton-Schulz",
        ),
        OptimizerInput(params=None, kwargs={"max_grad_norm": 1.0}, desc="clipping"),
    ]


def optim_error_inputs(device, dtype):
    def param(*shape, dtype=dtype, grad=None):
        p = Parameter(torch.randn(*shape, device=device, dtype=dtype))
        p.grad = grad
        return p

    m = param(2, 3)
    sparse = param(4, grad=torch.ones(4, device=device, dtype=dtype).to_sparse())
    construction = [
        (m, {}, TypeError, "should be an iterable of Tensors or dicts", "a bare tensor"),
        ([m, m], {}, ValueError, "lists a parameter twice", "torch warns; MuonZeRO refuses"),
        ([param(2, 3, 4, 5)], {}, ValueError, "Muon needs", "a 4-D tensor"),
        ([param(2, 3, dtype=torch.complex64)], {}, ValueError, "float32", "complex"),
        ([m], {"lr": float("nan")}, ValueError, "lr must be", "lr nan"),
        ([m], {"lr": torch.tensor(0.01)}, ValueError, "lr as a Tensor is not supported", "lr"),
        ([m], {"momentum": 1.0}, ValueError, "momentum", "momentum 1"),
    ]
    errors = [
        ErrorOptimizerInput(
            OptimizerInput(params=params, kwargs=kwargs, desc=desc),
            error_type=error,
            error_regex=regex,
        )
        for params, kwargs, error, regex, desc in construction
    ]
    return errors + [
        ErrorOptimizerInput(
            OptimizerInput(params=[m, sparse], kwargs={}, desc="a sparse gradient"),
            error_on=OptimizerErrorEnum.STEP_ERROR,
            error_type=ValueError,
            error_regex="does not support sparse gradients",
        )
    ]


MUON_ZERO = OptimizerInfo(
    RoutedMuonZeRO,
    optim_inputs_func=optim_inputs,
    optim_error_inputs_func=optim_error_inputs,
    supported_impls=(),
    not_og_supported_flags=("steps",),  # the rounding noise's counter, added to param groups later
    supports_complex=False,
    skips=(  # the slow tier: the parametrizations beyond one representative
        DecorateInfo(
            pytest.mark.slow,
            "TestOptimRenewed",
            "test_forloop_goes_right_direction",
            active_if=lambda kw: not (kw["contiguous"] and kw["with_lrsched"]),
        ),
        DecorateInfo(
            pytest.mark.slow,
            "TestOptimRenewed",
            "test_state_dict_deterministic",  # test_can_load_from_to_named_state_dict stays
        ),
    ),
)


def linear_problem(device, dtype, contiguous=True):
    """weight [10, 5] (Muon), bias [10] (AdamW), input [5]; non-contiguous: strided views."""
    shape = (10, 5, 2) if not contiguous else (10, 5)
    weight = Parameter(torch.randn(shape, device=device, dtype=dtype)[..., 0] if not contiguous
                       else torch.randn(shape, device=device, dtype=dtype))  # fmt: skip
    bias = torch.randn(10, 2, device=device, dtype=dtype)[..., 0] if not contiguous else None
    bias = Parameter(torch.randn(10, device=device, dtype=dtype) if bias is None else bias)
    return weight, bias, torch.randn(5, device=device, dtype=dtype)


def fwd_bwd(opt, weight, bias, x):
    opt.zero_grad()
    loss = (weight.mv(x) + bias).pow(2).sum()
    loss.backward()
    return loss


def named(params, is_named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params


def without_names(state_dict):
    out = deepcopy(state_dict)
    for g in out["param_groups"]:
        g.pop("param_names", None)
    return out


def state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def state_dict_post_hook(optimizer, state_dict):
    state_dict["ran_state_dict_pre_hook"] = state_dict["state"].pop("test", None) is not None
    return state_dict


def load_state_dict_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def load_state_dict_pre_hook2(optimizer, state_dict):
    mine = deepcopy(state_dict)  # a hook may return a new dict: that one is loaded
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def load_state_dict_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


class TestOptimRenewed(TestCase):
    @optims([MUON_ZERO])
    def test_optim_infos_do_not_specify_global_cliquey_kwargs(self, device, dtype, optim_info):
        for optim_input in optim_info.optim_inputs_func(device=device):
            flags = {"foreach", "fused", "differentiable"} & set(optim_input.kwargs)
            self.assertFalse(flags, optim_input.desc)

    @optims([MUON_ZERO])
    def test_errors(self, device, dtype, optim_info):
        for error_input in optim_info.optim_error_inputs_func(device=device, dtype=dtype):
            optim_input = error_input.optimizer_error_input
            raises = self.assertRaisesRegex(error_input.error_type, error_input.error_regex)
            if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
                with raises:
                    optim_info.optim_cls(optim_input.params, **optim_input.kwargs)
            else:
                opt = optim_info.optim_cls(optim_input.params, **optim_input.kwargs)
                with raises:
                    opt.step()

    @parametrize("contiguous", [True, False])
    @parametrize("with_lrsched", [True, False])
    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_forloop_goes_right_direction(
        self, device, dtype, optim_info, contiguous, with_lrsched
    ):
        for schedulers in optim_info.scheduler_inputs if with_lrsched else [[]]:
            for optim_input in optim_info.optim_inputs_func(device=device):
                weight, bias, x = linear_problem(device, dtype, contiguous)
                opt = optim_info.optim_cls([weight, bias], **optim_input.kwargs)
                scheds = [s(opt) for s in schedulers]
                first = fwd_bwd(opt, weight, bias, x).item()
                for _ in range(20):
                    loss = fwd_bwd(opt, weight, bias, x)
                    opt.step()
                    for s in scheds:
                        s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
                self.assertLess(fwd_bwd(opt, weight, bias, x).item(), first, optim_input.desc)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_param_group_with_lrscheduler_goes_right_direction(self, device, dtype, optim_info):
        for schedulers in optim_info.scheduler_inputs:
            weight, bias, x = linear_problem(device, dtype)
            opt = optim_info.optim_cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
            scheds = [s(opt) for s in schedulers]
            first = fwd_bwd(opt, weight, bias, x).item()
            for _ in range(20):
                loss = opt.step(functools.partial(fwd_bwd, opt, weight, bias, x))
                for s in scheds:
                    s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
            self.assertLess(fwd_bwd(opt, weight, bias, x).item(), first)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_tensor_lr(self, device, dtype, optim_info):
        """A tensor lr is refused with the words torch's test accepts as a refusal."""
        weight, bias, _ = linear_problem(device, dtype)
        with self.assertRaisesRegex(ValueError, "lr as a Tensor is not supported"):
            optim_info.optim_cls([weight, bias], lr=torch.tensor(1e-3))

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_param_groups_weight_decay(self, device, dtype, optim_info):
        for optim_input in optim_info.optim_inputs_func(device=device):
            weight, bias, x = linear_problem(device, dtype)
            no_decay = {**optim_input.kwargs, "weight_decay": 0.0}
            opt = optim_info.optim_cls(
                [dict(params=[weight], **optim_input.kwargs), dict(params=[bias], **no_decay)]
            )
            first = fwd_bwd(opt, weight, bias, x).item()
            for _ in range(20):
                loss = fwd_bwd(opt, weight, bias, x)
                opt.step()
            self.assertLess(loss.item(), first, optim_input.desc)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_param_groups_lr(self, device, dtype, optim_info):
        """A group's lr wins over the default: the 1e-28 default leaves `irrelevant` unchanged."""
        for optim_input in optim_info.optim_inputs_func(device=device):
            kwargs = {**optim_input.kwargs, "lr": optim_input.kwargs.get("lr", 1e-3)}
            weight, bias, x = linear_problem(device, dtype)
            irrelevant = Parameter(torch.randn(2, device=device, dtype=dtype))
            before = irrelevant.detach().clone()
            opt = optim_info.optim_cls(
                [dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28
            )
            first = fwd_bwd(opt, weight, bias, x).item()
            for _ in range(20):
                loss = fwd_bwd(opt, weight, bias, x)
                irrelevant.grad = torch.rand_like(irrelevant)
                opt.step()
            self.assertLess(loss.item(), first, optim_input.desc)
            self.assertEqual(irrelevant, before, atol=0, rtol=0)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_step_is_noop_when_params_have_no_grad(self, device, dtype, optim_info):
        params = [torch.randn(2, 3, device=device, dtype=dtype) for _ in range(2)]
        before = [p.clone() for p in params]
        for optim_input in optim_info.optim_inputs_func(device=device):
            opt = optim_info.optim_cls(params, **optim_input.kwargs)
            opt.step(lambda: torch.tensor([1.0]))
            self.assertEqual(params, before, atol=0, rtol=0)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_step_is_noop_for_zero_grads(self, device, dtype, optim_info):
        """Zero gradients and no weight decay: Muon's [5, 1] and AdamW's [5] stay bitwise."""
        for optim_input in optim_info.optim_inputs_func(device=device):
            params = [torch.randn(5, 1, device=device, dtype=dtype, requires_grad=True)]
            params.append(torch.randn(5, device=device, dtype=dtype, requires_grad=True))
            before = [p.detach().clone() for p in params]
            opt = optim_info.optim_cls(params, **{**optim_input.kwargs, "weight_decay": 0.0})
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            self.assertEqual(params, before, atol=0, rtol=0, msg=optim_input.desc)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_optimizer_can_be_printed(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for optim_input in optim_info.optim_inputs_func(device=device):
            self.assertIn(
                "Parameter Group 0", repr(optim_info.optim_cls(params, **optim_input.kwargs))
            )

    @parametrize("is_named_optim0", [True, False])
    @parametrize("is_named_optim1", [True, False])
    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_state_dict_deterministic(
        self, device, dtype, optim_info, is_named_optim0, is_named_optim1
    ):
        """Loaded into a fresh optimizer over equal (not identical) parameters, a state dict
        continues the run bitwise and saves back equal; a parameter listed twice (pytorch issue
        36831) is numbered alike."""
        for optim_input in optim_info.optim_inputs_func(device=device):
            weight = Parameter(torch.randn(2, 3, device=device, dtype=dtype))
            bias = Parameter(torch.randn(2, device=device, dtype=dtype))
            x = torch.randn(3, device=device, dtype=dtype)
            opt = optim_info.optim_cls(named([weight, bias], is_named_optim0), **optim_input.kwargs)
            for _ in range(10):
                opt.step(functools.partial(fwd_bwd, opt, weight, bias, x))
            with torch.no_grad():
                weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
            opt_c = optim_info.optim_cls(
                named([weight_c, bias_c], is_named_optim1), **optim_input.kwargs
            )
            opt_c.load_state_dict(deepcopy(opt.state_dict()))
            for _ in range(10):
                opt.step(functools.partial(fwd_bwd, opt, weight, bias, x))
                opt_c.step(functools.partial(fwd_bwd, opt_c, weight_c, bias_c, x))
                self.assertEqual(weight, weight_c, atol=0, rtol=0)
                self.assertEqual(bias, bias_c, atol=0, rtol=0)
            self.assertEqual(without_names(opt.state_dict()), without_names(opt_c.state_dict()))
            opt_c.param_groups.extend(opt_c.param_groups)
            self.assertEqual(
                without_names(opt.state_dict())["param_groups"][-1],
                without_names(opt_c.state_dict())["param_groups"][-1],
            )

    def _model_steps(self, device, dtype, optim_info, opt, model, x, steps=3):
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_can_load_older_state_dict(self, device, dtype, optim_info):
        """A state dict without the keys added later (not_og_supported_flags) loads and steps."""
        for optim_input in optim_info.optim_inputs_func(device=device):
            torch.manual_seed(1)
            model = torch.nn.Linear(10, 4).to(device=device, dtype=dtype)
            x = torch.rand(10, device=device, dtype=dtype)
            opt = optim_info.optim_cls(model.parameters(), **optim_input.kwargs)
            self._model_steps(device, dtype, optim_info, opt, model, x)
            old = deepcopy(opt.state_dict())
            for group in old["param_groups"]:
                for flag in optim_info.not_og_supported_flags:
                    group.pop(flag, None)
            opt.load_state_dict(old)
            self._model_steps(device, dtype, optim_info, opt, model, x, steps=1)

    @parametrize("is_named_optim0", [True, False])
    @parametrize("is_named_optim1", [True, False])
    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_can_load_from_to_named_state_dict(
        self, device, dtype, optim_info, is_named_optim0, is_named_optim1
    ):
        for optim_input in optim_info.optim_inputs_func(device=device):
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.Linear(4, 2))
            model.to(device=device, dtype=dtype)
            x = torch.rand(10, device=device, dtype=dtype)

            def params(is_named):
                return model.named_parameters() if is_named else model.parameters()

            opt = optim_info.optim_cls(params(is_named_optim0), **optim_input.kwargs)
            self._model_steps(device, dtype, optim_info, opt, model, x)
            opt2 = optim_info.optim_cls(params(is_named_optim1), **optim_input.kwargs)
            opt2.load_state_dict(deepcopy(opt.state_dict()))
            self._model_steps(device, dtype, optim_info, opt2, model, x, steps=1)
            if is_named_optim0 or is_named_optim1:  # names kept, in the routed groups' order
                names = [n for g in opt2.state_dict()["param_groups"] for n in g["param_names"]]
                self.assertEqual(names, ["0.weight", "1.weight", "0.bias", "1.bias"])

    @parametrize("is_named_optim", [True, False])
    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_save_load_equality_with_weights_only(self, device, dtype, optim_info, is_named_optim):
        weight = Parameter(torch.randn(2, 3, device=device, dtype=dtype))
        bias = Parameter(torch.randn(2, device=device, dtype=dtype))
        x = torch.randn(3, device=device, dtype=dtype)
        for optim_input in optim_info.optim_inputs_func(device=device):
            opt = optim_info.optim_cls(named([weight, bias], is_named_optim), **optim_input.kwargs)
            for _ in range(3):
                opt.step(functools.partial(fwd_bwd, opt, weight, bias, x))
            sd = opt.state_dict()
            with tempfile.TemporaryFile() as f:
                torch.save(sd, f)
                f.seek(0)
                self.assertEqual(torch.load(f), sd)
                f.seek(0)
                self.assertEqual(torch.load(f, weights_only=True), sd)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_load_nontensor_step(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        params.append(Parameter(torch.randn(3, device=device, dtype=dtype)))
        for p in params:
            p.grad = torch.rand_like(p)
        for optim_input in optim_info.optim_inputs_func(device=device):
            opt = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                opt.step()
            sd = deepcopy(opt.state_dict())
            for state in sd["state"].values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].item()
            opt.load_state_dict(sd)
            opt.step()

    @onlyCUDA
    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_state_dict_with_cuda_params(self, device, dtype, optim_info):
        """A CPU optimizer's state dict loads into one over the same parameters on the GPU and
        continues it (fp32 Newton-Schulz and exact gradients: CPU and GPU round alike to fp32)."""
        kwargs = {"grad_sync": "exact", "ns_dtype": torch.float32}
        params = [Parameter(torch.randn(2, 3, dtype=dtype)), Parameter(torch.randn(3, dtype=dtype))]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = optim_info.optim_cls(params, **kwargs)
        for _ in range(3):
            opt.step()
        with torch.no_grad():
            params_cuda = [Parameter(p.to(device, copy=True)) for p in params]
        for p, q in zip(params_cuda, params):
            p.grad = q.grad.to(device)
        opt_cuda = optim_info.optim_cls(params_cuda, **kwargs)
        sd, sd_c = deepcopy(opt.state_dict()), deepcopy(opt.state_dict())
        opt_cuda.load_state_dict(sd_c)
        self.assertEqual(sd, sd_c)  # loading left the caller's dict alone
        for _ in range(5):
            opt.step()
            opt_cuda.step()
            self.assertEqual(params, params_cuda, exact_device=False)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_state_dict_pre_hook(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        opt.register_state_dict_pre_hook(state_dict_pre_hook)
        self.assertEqual(opt.state_dict()["state"]["test"], 1)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_state_dict_post_hook(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        opt.register_state_dict_post_hook(state_dict_post_hook)
        self.assertFalse(opt.state_dict()["ran_state_dict_pre_hook"])

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_state_dict_pre_post_hook(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        opt.register_state_dict_pre_hook(state_dict_pre_hook)
        opt.register_state_dict_post_hook(state_dict_post_hook)
        state_dict = opt.state_dict()
        self.assertNotIn("test", state_dict["state"])
        self.assertTrue(state_dict["ran_state_dict_pre_hook"])

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_load_state_dict_pre_hook_and_prepend(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        state_dict = opt.state_dict()
        opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook1)
        opt.load_state_dict(state_dict)
        self.assertEqual(opt.param_groups[0]["lr"], 0.002)
        opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook2, prepend=True)
        opt.load_state_dict(state_dict)
        self.assertEqual(opt.param_groups[0]["lr"], 0.002)  # prepended: hook1 has the last word

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_load_state_dict_post_hook(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        opt.register_load_state_dict_post_hook(load_state_dict_post_hook)
        opt.load_state_dict(opt.state_dict())
        self.assertFalse(opt.state["ran_load_state_dict_pre_hook2"])
        self.assertTrue(opt.state["ran_load_state_dict_post_hook"])

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_load_state_dict_pre_post_hook(self, device, dtype, optim_info):
        opt = optim_info.optim_cls([torch.rand(2, 3, device=device, requires_grad=True)])
        opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook2)
        opt.register_load_state_dict_post_hook(load_state_dict_post_hook)
        opt.load_state_dict(opt.state_dict())
        self.assertTrue(opt.state["ran_load_state_dict_pre_hook2"])
        self.assertTrue(opt.state["ran_load_state_dict_post_hook"])

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_step_post_hook(self, device, dtype, optim_info):
        calls = []
        opt = optim_info.optim_cls([torch.tensor([1.0, 1.0], device=device)])
        handle = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o))
        opt.step()
        opt.step()
        handle.remove()
        opt.step()
        self.assertEqual(len(calls), 2)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_step_pre_hook(self, device, dtype, optim_info):
        calls = []
        opt = optim_info.optim_cls([torch.tensor([1.0, 1.0], device=device)])
        handle = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(o))
        opt.step()
        opt.step()
        handle.remove()
        opt.step()
        self.assertEqual(len(calls), 2)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_step_all_hooks(self, device, dtype, optim_info):
        """Global pre, local pre, local post, global post; for every optimizer, in that order."""
        data, params = [], [torch.tensor([1.0, 1.0], device=device)]
        opt, opt2 = optim_info.optim_cls(params), SGD(params)
        handles = [
            register_optimizer_step_pre_hook(lambda *a: data.append(0)),
            register_optimizer_step_post_hook(lambda *a: data.append(5)),
        ]
        for o in (opt, opt2):
            handles.append(o.register_step_pre_hook(lambda *a: data.append(1)))
            handles.append(o.register_step_post_hook(lambda *a: data.append(2)))
        try:
            opt.step()
            opt2.step()
            opt.step()
        finally:
            for h in handles:
                h.remove()
        opt.step()
        self.assertEqual(data, [0, 1, 2, 5] * 3)

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_deepcopy_copies_all_public_attrs(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for p in params:
            p.grad = torch.rand_like(p)

        def public(obj):
            return {k for k in vars(obj) if not k.startswith("_")}

        for optim_input in optim_info.optim_inputs_func(device=device):
            opt = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                opt.step()
            self.assertEqual(public(opt), public(deepcopy(opt)))

    @optims([MUON_ZERO], dtypes=[torch.float32])
    def test_non_empty_state(self, device, dtype, optim_info):
        model = torch.nn.Linear(5, 5).to(device=device, dtype=dtype)
        for optim_input in optim_info.optim_inputs_func(device=device):
            opt = optim_info.optim_cls(model.parameters(), **optim_input.kwargs)
            opt.zero_grad()
            model(torch.rand(2, 5, device=device, dtype=dtype)).sum().backward()
            opt.step()
            self.assertTrue(all(len(state) > 0 for state in opt.state.values()))
            self.assertEqual(len(opt.state), 2)


instantiate_device_type_tests(TestOptimRenewed, globals(), allow_mps=False)

if __name__ == "__main__":
    unittest.main()
