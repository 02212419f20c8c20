package main

import "syscall"

// workerProcAttr has the kernel send a worker SIGTERM when the coordinator
// dies, however it dies (even by SIGKILL, which it cannot handle).
func workerProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
}
