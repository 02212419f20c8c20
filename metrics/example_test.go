package metrics_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func Example() {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()

	m, err := metrics.New()
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry() // or prometheus.DefaultRegisterer: your choice
	reg.MustRegister(m)
	// Ten seconds, not the default 50ms: the embedded Redis runs its Lua in
	// this busy test process (under -race, slowly), and an example's output
	// must not depend on its speed.
	eng, err := throttle.New(rdb, throttle.WithObserver(m), throttle.WithTimeout(10*time.Second))
	if err != nil {
		panic(err)
	}
	lim, err := reserve.New(eng, "partner", throttle.PerMinute(10, 1))
	if err != nil {
		panic(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := lim.Allow(context.Background(), "eu"); err != nil {
			panic(err)
		}
	}

	families, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, f := range families {
		if f.GetName() == "slotbook_decisions_total" {
			for _, s := range f.GetMetric() {
				fmt.Println(s.GetLabel()[0].GetValue(), s.GetLabel()[1].GetValue(), s.GetCounter().GetValue())
			}
		}
	}
	// Output:
	// partner allowed 2
	// partner denied 1
}
