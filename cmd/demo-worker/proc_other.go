//go:build !linux

package main

import "syscall"

// workerProcAttr: only Linux can tie a worker's life to the coordinator's;
// elsewhere the coordinator stops its workers when it is stopped by a
// signal it can handle.
func workerProcAttr() *syscall.SysProcAttr { return nil }
