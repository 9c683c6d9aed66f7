"""Blind batch 17 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11


class _PGAgent(nn.Module):
    """A2C policy-gradient agent: shared MLP torso, policy-logits head, baseline (V) head, two optimizers."""

    def __init__(self, clip_wrong_head: bool, info_state_size: int = 6, num_actions: int = 3,
                 hidden: int = 16, max_global_gradient_norm: float = 0.5, entropy_cost: float = 0.01) -> None:
        super().__init__()
        self.clip_wrong_head = clip_wrong_head
        self.max_global_gradient_norm = max_global_gradient_norm
        self.entropy_cost = entropy_cost
        self.net_torso = nn.Sequential(nn.Linear(info_state_size, hidden), nn.ReLU())
        self.policy_logits_layer = nn.Linear(hidden, num_actions)
        self.baseline_layer = nn.Linear(hidden, 1)
        critic_network = nn.Sequential(self.net_torso, self.baseline_layer)
        pi_network = nn.Sequential(self.net_torso, self.policy_logits_layer)
        self.critic_optimizer = torch.optim.SGD(critic_network.parameters(), lr=0.01)
        self.pi_optimizer = torch.optim.SGD(pi_network.parameters(), lr=0.001)

    def minimize_with_clipping(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss.backward()
        if self.max_global_gradient_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), self.max_global_gradient_norm)
        optimizer.step()

    def critic_update(self, info_state: torch.Tensor, return_: torch.Tensor) -> torch.Tensor:
        baseline = torch.squeeze(self.baseline_layer(self.net_torso(info_state)), dim=1)
        critic_loss = torch.mean(F.mse_loss(baseline, return_))
        self.minimize_with_clipping(self.baseline_layer, self.critic_optimizer, critic_loss)
        return critic_loss

    def a2c_loss(self, policy_logits: torch.Tensor, baseline: torch.Tensor, actions: torch.Tensor,
                 returns: torch.Tensor) -> torch.Tensor:
        advantages = (returns - baseline).detach()
        policy_loss = F.cross_entropy(policy_logits, actions, reduction="none") * advantages
        total_loss = torch.mean(policy_loss, dim=0)
        probs = F.softmax(policy_logits, dim=1)
        entropy = -torch.sum(probs * F.log_softmax(policy_logits, dim=1), dim=1).mean()
        return total_loss - self.entropy_cost * entropy

    def pi_update(self, info_state: torch.Tensor, action: torch.Tensor, return_: torch.Tensor) -> torch.Tensor:
        torso_out = self.net_torso(info_state)
        policy_logits = self.policy_logits_layer(torso_out)
        baseline = torch.squeeze(self.baseline_layer(torso_out), dim=1)
        pi_loss = self.a2c_loss(policy_logits, baseline, action, return_)
        head = self.baseline_layer if self.clip_wrong_head else self.policy_logits_layer
        self.minimize_with_clipping(head, self.pi_optimizer, pi_loss)
        return pi_loss


_C11_STATES = torch.randn(16, 6, generator=_gen(1101))
_C11_ACTIONS = torch.randint(0, 3, (16,), generator=_gen(1102))
_C11_RETURNS = torch.randn(16, generator=_gen(1103)) * 20.0


def _c11_build(bug: bool) -> Case:
    """A2C learn step with max_global_gradient_norm: the pi update clips the baseline head's gradients."""
    torch.manual_seed(11)
    agent = _PGAgent(clip_wrong_head=bug).train()

    def step() -> torch.Tensor:
        agent.critic_update(_C11_STATES, _C11_RETURNS)
        return agent.pi_update(_C11_STATES, _C11_ACTIONS, _C11_RETURNS)

    return agent, step, _kw(optimizer=agent.pi_optimizer, inputs=_C11_STATES)


def _c11_proof(bug: bool) -> bool:
    """After the pi update, the policy head's gradient norm is far above max_global_gradient_norm (never clipped)."""
    agent, step, _ = _c11_build(bug)
    step()
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in agent.policy_logits_layer.parameters()]))
    return float(norm) > agent.max_global_gradient_norm * 1.01


CASES: list[BlindCase] = [
    BlindCase("b17-case-11", "https://github.com/google-deepmind/open_spiel/issues/827", "gradient clipping on the wrong parameters",
              "The policy update clips the gradients of the value head (which the detached policy loss never "
              "reaches) instead of the policy head, so max_global_gradient_norm never limits the policy step.",
              _c11_build, _c11_proof),
]
