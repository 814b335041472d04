//! The NCCL backend on real GPUs. Every test is ignored by default (no GPU
//! on the CPU CI); `scripts/gpu_check.sh` runs them with `--include-ignored`
//! (the two-GPU test only where a second GPU exists), and run that way
//! without the `nccl` feature or a CUDA device they fail rather than pass.
//! A world of one still runs NCCL's init and every collective.

use std::time::Duration;

use accel_dist::{
    Backend, Communicator, CommunicatorExt, Error, NcclCommunicator, NcclConfig, ProcessGroup,
    ProcessGroupConfig, ReduceOp, Result, TcpStore,
};
use candle_core::{DType, Device, Tensor};

/// `cuda:ordinal`; panics, naming the test, when this build or machine cannot run NCCL.
fn gpu(test: &str, ordinal: usize) -> Device {
    if !cfg!(feature = "nccl") {
        panic!("{test}: needs the `nccl` feature (run scripts/gpu_check.sh)");
    }
    accel_kernels::cuda_device(ordinal)
        .unwrap_or_else(|e| panic!("{test}: needs CUDA device {ordinal}: {e}"))
}

fn config() -> NcclConfig {
    NcclConfig::default().with_timeout(Duration::from_secs(60))
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn a_world_of_one_runs_every_collective_on_device_tensors() -> Result<()> {
    let dev = gpu("a_world_of_one_runs_every_collective_on_device_tensors", 0);
    let comm = NcclCommunicator::connect(None, 0, 1, &dev, config())?;
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let t = Tensor::arange(0f32, 12.0, &dev)?.reshape((4, 3))?;
    let want = t.to_vec2::<f32>()?;
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        assert_eq!(comm.all_reduce_tensor(&t, op)?.to_vec2::<f32>()?, want);
    }
    let same = t.clone();
    comm.all_reduce_tensor_inplace(&same, ReduceOp::Sum)?;
    assert_eq!(t.to_vec2::<f32>()?, want);
    assert_eq!(comm.all_gather_tensor(&t)?.to_vec2::<f32>()?, want);
    assert_eq!(
        comm.reduce_scatter_tensor(&t, ReduceOp::Sum)?
            .to_vec2::<f32>()?,
        want
    );
    assert_eq!(comm.broadcast_tensor(&t, 0)?.to_vec2::<f32>()?, want);
    for dtype in [
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::I64,
        DType::U8,
    ] {
        let x = t.to_dtype(dtype)?;
        let y = comm.all_reduce_tensor(&x, ReduceOp::Sum)?;
        assert_eq!(y.to_dtype(DType::F32)?.to_vec2::<f32>()?, want, "{dtype:?}");
    }
    // A view with an offset works in place; a transposed view is refused.
    let row = t.narrow(0, 1, 2)?;
    comm.all_reduce_tensor_inplace(&row, ReduceOp::Sum)?;
    let err = comm
        .all_reduce_tensor_inplace(&t.t()?, ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(err, Error::RequiresContiguous { .. }), "{err}");
    let err = comm
        .all_reduce_tensor(&t.to_dtype(DType::I64)?, ReduceOp::Mean)
        .unwrap_err();
    assert!(matches!(err, Error::UnsupportedReduce { .. }), "{err}");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn host_buffers_and_cpu_tensors_are_staged_through_the_device() -> Result<()> {
    let dev = gpu(
        "host_buffers_and_cpu_tensors_are_staged_through_the_device",
        0,
    );
    let comm = NcclCommunicator::connect(None, 0, 1, &dev, config())?;
    let mut v = vec![1.5f32, -2.0, 3.0];
    comm.all_reduce((&mut v).into(), ReduceOp::Sum)?;
    assert_eq!(v, [1.5, -2.0, 3.0]);
    comm.barrier()?;
    let obj = ("rank".to_string(), 0u32);
    assert_eq!(comm.gather_object(&obj)?, vec![obj.clone()]);
    let mut objs = vec![1u32, 2, 3];
    comm.broadcast_object_list(&mut objs, 0)?;
    assert_eq!(objs, [1, 2, 3]);
    let cpu = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
    assert_eq!(
        comm.all_reduce_tensor(&cpu, ReduceOp::Mean)?
            .to_vec1::<f32>()?,
        [1.0, 2.0]
    );
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn process_group_picks_nccl_when_asked_or_for_cuda_training() -> Result<()> {
    gpu(
        "process_group_picks_nccl_when_asked_or_for_cuda_training",
        0,
    );
    let group = ProcessGroup::init(ProcessGroupConfig::default().with_backend(Backend::Nccl))?;
    assert!(group.device().is_cuda());
    let comm = group.communicator();
    let t = Tensor::ones(5, DType::F32, group.device())?;
    assert_eq!(
        comm.all_reduce_tensor(&t, ReduceOp::Sum)?
            .to_vec1::<f32>()?,
        [1.0; 5]
    );
    comm.barrier()
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn init_gives_up_when_a_peer_never_arrives() -> Result<()> {
    let dev = gpu("init_gives_up_when_a_peer_never_arrives", 0);
    let timeout = Duration::from_secs(2);
    let store = TcpStore::host("127.0.0.1:0".parse().unwrap(), "tok", timeout)?;
    let start = std::time::Instant::now();
    let err = NcclCommunicator::connect(Some(&store), 0, 2, &dev, config().with_timeout(timeout))
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(30), "{err}");
    eprintln!("expected error: {err}");
    Ok(())
}

#[test]
#[ignore = "needs two CUDA GPUs (run scripts/gpu_check.sh)"]
fn two_ranks_on_two_gpus_reduce_and_gather() -> Result<()> {
    gpu("two_ranks_on_two_gpus_reduce_and_gather", 0);
    gpu("two_ranks_on_two_gpus_reduce_and_gather", 1);
    let timeout = Duration::from_secs(60);
    let host = TcpStore::host("127.0.0.1:0".parse().unwrap(), "tok", timeout)?;
    let addr = host.addr();
    let rank = move |r: usize, store: TcpStore| {
        std::thread::spawn(move || -> Result<(Vec<f32>, Vec<f32>)> {
            let dev = accel_kernels::cuda_device(r)?;
            let comm = NcclCommunicator::connect(Some(&store), r, 2, &dev, config())?;
            let t = Tensor::new(&[r as f32 + 1.0, 10.0], &dev)?;
            comm.all_reduce_tensor_inplace(&t, ReduceOp::Sum)?;
            let g = comm.all_gather_tensor(&Tensor::new(&[r as f32], &dev)?)?;
            comm.barrier()?;
            Ok((t.to_vec1()?, g.to_vec1()?))
        })
    };
    let other = rank(1, TcpStore::connect(addr, "tok", timeout)?);
    let mine = rank(0, host).join().expect("rank 0 panicked")?;
    let theirs = other.join().expect("rank 1 panicked")?;
    for (sum, gathered) in [mine, theirs] {
        assert_eq!(sum, [3.0, 20.0]);
        assert_eq!(gathered, [0.0, 1.0]);
    }
    Ok(())
}
