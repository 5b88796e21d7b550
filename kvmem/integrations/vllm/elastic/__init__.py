"""Elastic KV memory inside vLLM (``KVMEM_VLLM_KV_MEMORY=elastic``).

- ``plugin``: turns it on where vLLM builds its configuration (adds the connector);
- ``config``: the settings, from the environment or the connector's extra config;
- ``connector``: ``KvmemElasticConnector``, which vLLM builds in the scheduler and in every
  worker; ``scheduler``: its side in the scheduler (``ElasticScheduler``);
- ``watch``: wakes an idle engine core when another engine asks it for memory;
- ``pool``: in the scheduler, a page-aware free-block queue over ``kvmem.memory``'s page
  table, under the device's shared ledger;
- ``worker``: in each worker, vLLM's KV buffer over a ``kvmem.memory`` reservation, each
  step's page decisions applied;
- ``layout``: block ranges as granules of vLLM's KV layout.

Importing this package imports neither vLLM nor torch.
"""
