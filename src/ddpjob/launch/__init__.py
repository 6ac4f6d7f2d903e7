"""The node agent, ``ddpjob launch``: where this node sits in the job (scheduler detection ->
Plan), torchrun's arguments, stop signals relayed to the workers, the rendezvous watch, attempts.
It starts the training loop only as torchrun's worker command, never by import.
"""
