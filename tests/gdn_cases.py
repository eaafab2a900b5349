"""Shared cases of the Gated DeltaNet step kernel (interpreter test and tests/gpu)."""
from __future__ import annotations

import torch


def make_case(rows_per_seq, num_k_heads=2, num_v_heads=4, k_dim=16, v_dim=16, kernel=4, num_slots=6,
              dtype=torch.float32, device="cpu", seed=0, row_stride_pad=3, with_norm=False):
    """Random inputs of one step: mixed rows as a strided view (as the fused projection's split
    gives), pools with non-zero states, sequences in shuffled slots (0 rows allowed)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    num_rows = sum(rows_per_seq)
    z_width = num_v_heads * v_dim
    wide = rnd(num_rows, conv_dim + 2 * num_v_heads + z_width + row_stride_pad)
    norm_weight = 1.0 + 0.2 * rnd(v_dim)
    mixed = wide[:, :conv_dim]
    a = wide[:, conv_dim:conv_dim + num_v_heads]
    b = wide[:, conv_dim + num_v_heads:conv_dim + 2 * num_v_heads]
    state_dtype = torch.promote_types(dtype, torch.float32)
    case = dict(
        mixed=mixed, a=a, b=b, conv_weight=0.5 * rnd(conv_dim, 1, kernel), a_log=0.3 * rnd(num_v_heads),
        dt_bias=rnd(num_v_heads), conv_pool=rnd(num_slots, conv_dim, kernel - 1),
        ssm_pool=0.1 * rnd(num_slots, num_v_heads, k_dim, v_dim),
        slots=torch.randperm(num_slots, generator=gen)[:len(rows_per_seq)].to(torch.int32),
        cu_seqlens=torch.tensor([0] + list(torch.tensor(rows_per_seq).cumsum(0)), dtype=torch.int32))
    for name, x in case.items():
        if name == "ssm_pool":
            case[name] = x.to(device=device, dtype=state_dtype)
        elif x.is_floating_point():
            case[name] = x.to(device=device, dtype=dtype if name != "conv_weight" else dtype)
        else:
            case[name] = x.to(device)
    # keep mixed / a / b strided views of one tensor on the device too
    wide = wide.to(device=device, dtype=dtype)
    case["mixed"], case["a"], case["b"] = (wide[:, :conv_dim], wide[:, conv_dim:conv_dim + num_v_heads],
                                           wide[:, conv_dim + num_v_heads:conv_dim + 2 * num_v_heads])
    norm = None
    if with_norm:                      # the gated norm's z: another strided view of the projection
        z = wide[:, conv_dim + 2 * num_v_heads:conv_dim + 2 * num_v_heads + z_width].view(num_rows, num_v_heads, v_dim)
        norm = (norm_weight.to(device=device, dtype=dtype), z, 1e-6)
    return dict(case, max_rows=max(rows_per_seq), num_k_heads=num_k_heads, k_dim=k_dim, norm=norm)


def compare(case, step, reference) -> dict[str, float]:
    """Max abs error of every result of `step` against `reference` on copies of the case's pools:
    out, per-step states, stashed conv inputs (the columns a sequence wrote), advanced pools."""
    errors = {}
    for keep in (True, False):
        got_case = dict(case, conv_pool=case["conv_pool"].clone(), ssm_pool=case["ssm_pool"].clone())
        ref_case = dict(case, conv_pool=case["conv_pool"].clone(), ssm_pool=case["ssm_pool"].clone())
        out, steps, stash = step(**got_case, keep_steps=keep)
        ref_out, ref_steps, ref_stash = reference(**ref_case, keep_steps=keep)
        errors[f"out/{keep}"] = (out.double() - ref_out.double()).abs().max().item()
        if keep:
            cu = case["cu_seqlens"].tolist()
            errors["steps"] = max((steps[i, :cu[i + 1] - cu[i]].double() - ref_steps[i, :cu[i + 1] - cu[i]].double())
                                  .abs().max().item() if cu[i + 1] > cu[i] else 0.0 for i in range(len(cu) - 1))
            kernel = case["conv_weight"].shape[-1]
            errors["stash"] = max((stash[i, :, :kernel - 1 + cu[i + 1] - cu[i]].double()
                                   - ref_stash[i, :, :kernel - 1 + cu[i + 1] - cu[i]].double()).abs().max().item()
                                  for i in range(len(cu) - 1))
            errors["pools untouched"] = float(not (torch.equal(got_case["conv_pool"], case["conv_pool"])
                                                   and torch.equal(got_case["ssm_pool"], case["ssm_pool"])))
        else:
            errors["conv_pool"] = (got_case["conv_pool"].double() - ref_case["conv_pool"].double()).abs().max().item()
            errors["ssm_pool"] = (got_case["ssm_pool"].double() - ref_case["ssm_pool"].double()).abs().max().item()
    return errors
