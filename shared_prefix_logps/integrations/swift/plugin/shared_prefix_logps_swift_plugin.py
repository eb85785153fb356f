"""ms-swift ``--external_plugins`` file of shared-prefix-logps: every log-prob pass of ms-swift's GRPOTrainer through
the shared prefix (``shared_prefix_logps.integrations.swift``; options from the ``SHARED_PREFIX_LOGPS_SWIFT*``
environment variables).

ms-swift imports this file in every rank before it builds the trainer. It is loaded by path, not as part of its
package, hence the absolute import.
"""

from shared_prefix_logps.integrations.swift.install import install_from_plugin

install_from_plugin()
