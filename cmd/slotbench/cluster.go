package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// cluster is a Redis Cluster of redis-server processes on loopback that
// slotbench started for its cluster points (redistest.StartCluster does the
// same for tests, bound to a testing.TB).
type cluster struct {
	addrs []string
	procs []*exec.Cmd
	dir   string
}

// launchCluster starts n masters (no replicas) on free 127.0.0.1 ports,
// joins them with redis-cli --cluster create and waits until every node
// says the cluster is ok.
func launchCluster(n int) (_ *cluster, err error) {
	server, err1 := exec.LookPath("redis-server")
	cli, err2 := exec.LookPath("redis-cli")
	if err1 != nil || err2 != nil {
		return nil, errors.New("redis-server and redis-cli must be on PATH (or pass -scaling-cluster=false)")
	}
	dir, err := os.MkdirTemp("", "slotbench-cluster-")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir}
	defer func() {
		if err != nil {
			c.stop()
		}
	}()
	for i := 0; i < n; i++ {
		port, err := freeLoopbackPort()
		if err != nil {
			return nil, err
		}
		p := strconv.Itoa(port)
		cmd := exec.Command(server, "--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--dbfilename", "dump-"+p+".rdb", "--logfile", "redis-"+p+".log", "--loglevel", "warning",
			"--cluster-enabled", "yes", "--cluster-config-file", "nodes-"+p+".conf", "--cluster-node-timeout", "5000")
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		c.procs = append(c.procs, cmd)
		c.addrs = append(c.addrs, net.JoinHostPort("127.0.0.1", p))
	}
	for _, a := range c.addrs {
		if err := untilOK(func(ctx context.Context, cl *redis.Client) error { return cl.Ping(ctx).Err() }, a); err != nil {
			return nil, err
		}
	}
	args := append([]string{"--cluster", "create"}, c.addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	for _, a := range c.addrs {
		if err := untilOK(func(ctx context.Context, cl *redis.Client) error {
			info, err := cl.ClusterInfo(ctx).Result()
			if err == nil && !strings.Contains(info, "cluster_state:ok") {
				err = errors.New("cluster_state is not ok")
			}
			return err
		}, a); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// untilOK retries f on a client of addr for up to 20 s.
func untilOK(f func(context.Context, *redis.Client) error, addr string) error {
	cl := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer cl.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := f(ctx, cl)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends the servers this cluster started, by their pids, and removes
// their directory.
func (c *cluster) stop() {
	for _, p := range c.procs {
		if p.Process == nil {
			continue
		}
		_ = p.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = p.Process.Kill()
			<-done
		}
	}
	_ = os.RemoveAll(c.dir)
}

// freeLoopbackPort returns a free port whose cluster bus port (10000
// above it) is a port too.
func freeLoopbackPort() (int, error) {
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if port+10000 <= 65535 {
			return port, nil
		}
	}
}
