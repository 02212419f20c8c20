package redistest

import "syscall"

// sysProcAttr makes the server die with the test process.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
