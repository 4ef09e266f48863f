"""Memory conformance over every registered memory policy (installed plugins included): loss and gradients
unchanged within the policy's declared grad_rtol (gemzoo.testing.memory)."""

from gemzoo.testing.memory import check_memory_policy


def test_memory_policy_keeps_loss_and_gradients(memory_name, registry_entry):
    check_memory_policy(registry_entry("memory", memory_name))
