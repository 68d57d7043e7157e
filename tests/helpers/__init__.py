"""Fault-injection helpers shared by the tests (I/O faults in ``faults_io``, training faults in ``faults_train``)."""
