package lease_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/lease"
	"github.com/slotbook/slotbook/throttle"
)

// At most 2 holders of a key at once, across every process sharing the
// Redis: the third caller finds none free.
func ExampleSemaphore() {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	// A generous timeout: the embedded Redis runs its Lua in this process.
	eng, err := throttle.New(rdb, throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}
	sem, err := lease.New(eng, "partner", 2, lease.WithTTL(30*time.Second))
	if err != nil {
		panic(err)
	}
	defer sem.Close(context.Background())

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := sem.Acquire(ctx, "tenant-42")
	if err != nil {
		panic(err)
	}
	b, err := sem.Acquire(ctx, "tenant-42")
	if err != nil {
		panic(err)
	}
	_, ok, err := sem.TryAcquire(ctx, "tenant-42")
	fmt.Println("third lease free:", ok, err)
	fmt.Println("tokens increase:", b.Token() > a.Token())
	if err := a.Release(ctx); err != nil {
		panic(err)
	}
	c, ok, err := sem.TryAcquire(ctx, "tenant-42")
	fmt.Println("after a release:", ok, err)
	_ = b.Release(ctx)
	_ = c.Release(ctx)
	// Output:
	// third lease free: false <nil>
	// tokens increase: true
	// after a release: true <nil>
}
