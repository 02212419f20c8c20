//go:build !unix

package main

import (
	"net"
	"testing"
)

// refusedAddr returns a loopback address nothing listens on: found free
// and released (another test's server could take it meanwhile).
func refusedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}
