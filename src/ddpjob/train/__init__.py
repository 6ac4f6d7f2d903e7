"""One worker, ``ddpjob train``: process set-up, the loop, data (sampling, feeds, batches),
losses, optimizer and schedule, evaluation, metrics and trackers, the phase watchdog, traces and
stragglers, the stop signal, RNG states.
"""
