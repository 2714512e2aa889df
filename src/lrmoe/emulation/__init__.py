"""An emulated cluster on one machine: nodes as network namespaces with shaped links.

Each node of a run is a network namespace (with its own process, mount and host-name namespaces)
whose ranks talk over the node's own loopback, unshaped (the emulation's NVLink); its one link,
a veth pair into a bridge in a namespace of the run's own (the switch), is shaped at its egress
in both directions. The nodes meet through the rendezvous a user's machines use: one
``torch.distributed.run`` per node, c10d at node 0's address. It is time on a shaped virtual link
between processes of one machine, not a GPU cluster: it makes the ratio of transfer to compute
realistic (:mod:`lrmoe.emulation.paper_link`), not the absolute times.

``config`` (the ``[cluster]`` table and its flags), ``namespaces`` (building and removing the
nodes and links), ``budgets`` (the budgets that follow the link), ``paper_link`` (the link that
gives the testbed the paper's ratio of dispatch to expert GEMMs).
"""
